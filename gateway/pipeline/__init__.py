"""A chat request's way through the gateway, with no HTTP in it: ``Pipeline.run`` takes
a checked request and the settings resolved for it, and returns an ``Outcome``, the
typed decision and the answer as a stream of events (docs/architecture.md, "The
request's way through the code", steps 1-7)."""
