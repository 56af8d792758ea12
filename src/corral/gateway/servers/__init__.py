"""The server side of the gateway: the runtime that implements the scheduler's `Effects` over
model server processes, their lifecycle, naps and swaps, the page cache, reloads, and what the
gateway reports of them (status, metrics, events)."""
