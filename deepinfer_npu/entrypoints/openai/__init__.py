"""The OpenAI-compatible HTTP API: request models, completion / chat handlers and the FastAPI application."""
