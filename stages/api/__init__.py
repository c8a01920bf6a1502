"""The OpenAI-compatible HTTP layer shared by the stage servers that answer chat requests.

``routes.create_app`` builds the app; ``parse`` reads a body into the request model at a bounded cost,
``chat`` converts requests, ``schemas`` holds the wire shapes, ``openapi`` documents the routes,
``images`` decodes image URLs within ``ImageLimits``, ``errors`` makes every failure OpenAI-shaped.
``completions`` adds ``/v1/completions`` (the legacy API, text only) beside chat: its body in
``completion_schema``, its prompts in ``completion_prompts``, its answers in ``completion_bodies``.
Import from the submodules (this package imports nothing, so the CLI stays fast to start).
"""
