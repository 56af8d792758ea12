"""Relay processes: the front processes that carry the models' answers, one scheduler
deciding for all (`corral serve --workers N`; docs/design/gateway.md, "Relay processes")."""
