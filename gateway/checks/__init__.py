"""Checks of the gateway's own shortcuts: a random share of cache hits, small-model
answers, early stops and deadline fallbacks is answered again, in the background, by
the path the shortcut skipped; the two answers are compared, each check is kept as one
record in the outcome store, and live estimates with intervals are read from them."""
