"""The pure scheduling core: no I/O, no asyncio, time from an injected clock."""

from corral.core.effects import Effects
from corral.core.placement import DeviceView, Plan, ResidentView, plan_placement
from corral.core.policies import Cost, Fifo, FifoPlus, Grouped, Policy, Priority, make_policy
from corral.core.scheduler import Clock, Scheduler
from corral.core.tiers import SchedulerBug
from corral.core.types import Decision, Grant, Lifecycle, Request, RequestState

__all__ = [
    "Clock",
    "Cost",
    "Decision",
    "DeviceView",
    "Effects",
    "Fifo",
    "FifoPlus",
    "Grant",
    "Grouped",
    "Lifecycle",
    "Plan",
    "Policy",
    "Priority",
    "Request",
    "RequestState",
    "ResidentView",
    "Scheduler",
    "SchedulerBug",
    "make_policy",
    "plan_placement",
]
