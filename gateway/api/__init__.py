"""The HTTP API: routes, auth, errors, the OpenAI wire format, and the rendering of an outcome."""
