"""OpenAI- and Anthropic-compatible HTTP API (docs/api.md says what is supported and why).

    app.py               create_app(service, config): routes, error shapes, security gate; ServerThread
    context.py           ServerConfig; the loaded model for a request (waiting while it loads)
    security.py          Host (DNS rebinding), Origin, API key, body size
    errors.py            APIError and every error in the called API's own shape
    schemas.py           request bodies (pydantic; unknown fields accepted)
    prompts.py           API request -> canonical chat messages -> template -> tokens; sampling params
    streaming.py         a job's events from the engine thread to asyncio; SSE; cancel on disconnect
    openai_routes.py     /v1/models, /v1/chat/completions, /v1/completions
    responses_routes.py  /v1/responses (Codex)
    anthropic_routes.py  /v1/messages, /v1/messages/count_tokens (Claude Code)
"""
