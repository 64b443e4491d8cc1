"""genie_rt.server: the HTTP server - a drop-in for llama.cpp's llama-server (its OpenAI-compatible
and native routes and launch flags), with Ollama's API, Anthropic's Messages API, OpenAI's
Responses API and a small chat page over the same engine worker.

Entry points: `app.create_app(engine_or_loader, settings)` and `app.serve(args, engine_config)`
(`genie-rt serve`, whose options are in cli_args.py). docs/server.md lists every route and field.
"""
