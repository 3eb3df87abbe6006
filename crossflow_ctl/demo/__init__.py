"""The demo: a whole cluster on loopback, a router replaying a trace, a live view."""
