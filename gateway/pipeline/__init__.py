"""A chat request's way through the gateway, with no HTTP in it: ``Pipeline.run`` takes
a checked request, the settings resolved for it and its ``Exchange``, and returns the
answer as a stream of events with the decision taken so far; the request then settles
once, with its complete decision (docs/architecture.md, steps 1-8)."""
