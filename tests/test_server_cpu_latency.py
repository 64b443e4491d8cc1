"""The server stays responsive while the CPU back-end generates (issue 19): the Numba
kernels release the GIL, so /health answers while a long reply is generated.

What this guards against is the GIL held through generation: /health would then wait for the
whole reply (seconds). So the typical (median) answer must be fast and no answer may wait
a second; a single slow one on a loaded 2-core machine (251 ms once in CI's slow stage,
2026-12-03) is the scheduler, not the engine, and is not a failure. Speed itself is measured
by benchmarks, not asserted here."""
import threading
import time

import pytest

from test_real_models import real_model

httpx = pytest.importorskip("httpx")


@pytest.mark.slow
def test_health_answers_quickly_while_the_cpu_back_end_generates(tmp_path):
    import subprocess
    import sys
    model = real_model("gemma3-270m")
    if model is None:
        pytest.skip("Gemma 3 270M is not on this machine")
    port = 18000 + (hash(str(tmp_path)) % 1000)
    proc = subprocess.Popen([sys.executable, "-m", "genie_rt.engine.cli", "serve", "-m", str(model),
                             "--backend", "cpu", "--port", str(port), "--ctx", "1024"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=120) as c:
            for _ in range(600):
                try:
                    if c.get(f"{base}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            else:
                pytest.fail("the server did not become ready")
            done = {}
            body = {"prompt": "Once upon a time " * 50, "n_predict": 160, "temperature": 0, "ignore_eos": True}
            worker = threading.Thread(target=lambda: done.update(r=httpx.post(f"{base}/completion", json=body,
                                                                                 timeout=120).json()))
            worker.start()
            time.sleep(0.5)
            lat = []
            while worker.is_alive():
                t0 = time.perf_counter()
                assert c.get(f"{base}/health").status_code == 200
                lat.append(time.perf_counter() - t0)
                time.sleep(0.05)
            worker.join()
            assert done["r"]["tokens_predicted"] == 160
            assert len(lat) >= 5, "the reply finished before /health was asked"
            lat.sort()
            median = lat[len(lat) // 2]
            assert median < 0.1 and lat[-1] < 1.0, \
                f"/health during generation: median {median * 1000:.0f} ms, worst {lat[-1] * 1000:.0f} ms"
    finally:
        proc.terminate()
        proc.wait(30)
