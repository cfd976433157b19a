"""Serving entry points: the asyncio engine (``AsyncLLM``), chat templates, metrics and the OpenAI server."""
