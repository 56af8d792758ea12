"""The request pipeline: a call admitted, granted a model by the scheduler, sent upstream
(or coalesced, or forwarded to another host) and its answer relayed back."""
