"""engine/cuda_graph.py's parts, on a stand-in driver (no GPU): a capture cut once becomes two
graphs, instantiated and uploaded in order, launched in order by one replay; its node count is
theirs together; `cut` ends a part only of the graph capturing on that stream; a capture that
fails destroys every part it made."""
from types import SimpleNamespace

import pytest

from genie_rt.engine import cuda_graph


class _Driver:
    """The driver calls CUDAGraph makes, logged; graph i has 10 + i nodes."""

    CUstreamCaptureMode = SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=2)

    def __init__(self):
        self.log, self.n = [], 0

    def cuStreamBeginCapture(self, stream, mode):
        self.log.append("begin")
        return (0,)

    def cuStreamEndCapture(self, stream):
        self.n += 1
        self.log.append(f"end g{self.n}")
        return 0, f"g{self.n}"

    def cuGraphInstantiate(self, graph, flags):
        self.log.append(f"instantiate {graph}")
        return 0, "e" + graph[1:]

    def cuGraphUpload(self, exe, stream):
        self.log.append(f"upload {exe}")
        return (0,)

    def cuGraphGetNodes(self, graph, count):
        return 0, None, 10 + int(graph[1:])

    def cuGraphLaunch(self, exe, stream):
        self.log.append(f"launch {exe}")
        return (0,)

    def cuGraphExecDestroy(self, exe):
        self.log.append(f"destroy {exe}")

    def cuGraphDestroy(self, graph):
        self.log.append(f"destroy {graph}")


def _graph(stream):
    g = cuda_graph.CUDAGraph(stream)
    g._driver = _Driver()
    return g


def test_a_capture_cut_once_is_two_parts_launched_in_order():
    stream = SimpleNamespace(handle=1)
    g = _graph(stream)
    with g.capture():
        cuda_graph.cut(SimpleNamespace(handle=1))   # another stream object: not this capture's
        cuda_graph.cut(stream)
    assert g.parts == 2 and g.n_nodes == 11 + 12
    assert g._driver.log == ["begin", "end g1", "begin", "end g2", "instantiate g1", "upload e1",
                             "instantiate g2", "upload e2"]
    g._driver.log.clear()
    g.replay()
    assert g._driver.log == ["launch e1", "launch e2"]
    cuda_graph.cut(stream)                          # no capture now: nothing happens
    assert g._driver.log == ["launch e1", "launch e2"] and g.parts == 2
    g.close()
    assert g.parts == 0 and {"destroy e1", "destroy e2", "destroy g1", "destroy g2"} <= set(g._driver.log)


def test_an_uncut_capture_is_one_part_and_a_failed_one_destroys_its_parts():
    stream = SimpleNamespace(handle=2)
    g = _graph(stream)
    with g.capture():
        pass
    assert g.parts == 1 and g.n_nodes == 11
    bad = _graph(stream)
    with pytest.raises(ValueError):
        with bad.capture():
            cuda_graph.cut(stream)
            raise ValueError("a launch failed")
    assert "destroy g1" in bad._driver.log and "destroy g2" in bad._driver.log
    assert bad._graphs == [] and bad._execs == [] and not cuda_graph._CAPTURING
    with pytest.raises(cuda_graph.CUDAGraphError):
        bad.replay()


def test_a_part_that_fails_to_instantiate_destroys_the_parts_before_it():
    stream = SimpleNamespace(handle=3)
    g = _graph(stream)
    real = g._driver.cuGraphInstantiate
    g._driver.cuGraphInstantiate = lambda graph, flags: (1, None) if graph == "g2" else real(graph, flags)
    with pytest.raises(cuda_graph.CUDAGraphError, match="cuGraphInstantiate"):
        with g.capture():
            cuda_graph.cut(stream)
    assert {"destroy e1", "destroy g1", "destroy g2"} <= set(g._driver.log)
    assert g._graphs == [] and g._execs == [] and not cuda_graph._CAPTURING


def test_a_failed_block_is_the_error_raised_even_when_the_capture_cannot_end():
    stream = SimpleNamespace(handle=4)
    g = _graph(stream)
    g._driver.cuStreamEndCapture = lambda s: (900, None)       # e.g. a capture the failed launch invalidated
    with pytest.raises(KeyError):
        with g.capture():
            raise KeyError("the launch's own error")
    assert g._graphs == [] and not cuda_graph._CAPTURING
