"""The OpenAI-compatible HTTP layer shared by the stage servers that answer chat requests.

``routes.create_app`` builds the app from ``app_config`` (its live parts and its values); ``lifetime``
holds a request's admission, liveness, keep-alives and abort; ``parse`` reads a body into the request
model at a bounded cost (``bounded_json``), ``chat`` converts requests (``sampling``: the fields shared
with completions; ``tools``: tools in and out), ``schemas`` holds the chat request (its messages in
``message_schemas``, the bounds and field types both request models share in ``schema_types``),
``chat_response`` / ``chat_choices`` the chat answer, ``common_schemas`` the other answers, ``openapi``
documents the routes, ``images`` decodes image URLs within ``ImageLimits``, ``errors`` makes every
failure OpenAI-shaped. ``completions`` adds ``/v1/completions`` (the legacy API, text only) beside chat:
its body in ``completion_schema``, its prompts in ``completion_prompts``, its answers in
``completion_bodies``. Import from the submodules (this package imports nothing, so the CLI stays fast
to start).
"""
