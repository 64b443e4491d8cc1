"""genie_rt.server: the OpenAI-compatible HTTP server (llama-server drop-in).

Entry points: `app.create_app(engine_or_loader, settings)` and `app.serve(args, engine_config)`
(`genie-rt serve`). docs/server.md lists every route and field.
"""
