"""Bounds shared by every front door (no imports: cheap for any command to load)."""

# Request priorities are bounded so a queue's weight (priority_base ** priority, summed over
# millions of requests) stays a finite float: 10 ** 100 is far from float's 1.8e308.
PRIORITY_MIN, PRIORITY_MAX = -100, 100

# A worker not seen for this long (or two of its leases) counts as gone: its models as unserved.
PRESENCE_S = 60.0
