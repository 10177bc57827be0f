"""What a training step sends between GPUs: DeepSpeed's comms logger around one step.

The logger synchronises the device after every collective, so a logged step is slower than an unlogged one;
each call's own time is still measured from its start to its end (waiting for a slower peer included).
DeepSpeed 0.19 records, at each call, its timer's running total (elapsed(reset=False)), so an op's total time
is its largest record after its timer is reset, not the sum of the records.
"""
from __future__ import annotations


def logged_collectives(step, ops: tuple = ()) -> dict:
    """Run `step()` under DeepSpeed's comms logger; returns {op: {message bytes: [calls, running totals (ms),
    ...]}} for the collectives in `ops` (every collective when empty)."""
    import deepspeed.comm as dist
    from deepspeed.comm import comm as comm_module

    for op in ops or ("all_to_all_single",):
        comm_module.timers(op).reset()
    dist.comms_logger.reset_data()
    dist.configure(enabled=True, prof_all=not ops, prof_ops=list(ops), verbose=False)
    try:
        step()
        return dist.comms_logger.get_raw_data()
    finally:
        dist.configure(enabled=False)


def call_counts(logged: dict) -> dict:
    """{op: {message bytes: calls}} of logged_collectives' records (what planner/communication.py reads)."""
    return {op: {int(size): entry[0] for size, entry in records.items()} for op, records in logged.items()}


def total_seconds(records: dict) -> float:
    """Seconds of all calls of one op from its records {message bytes: [calls, running totals (ms), ...]}."""
    return max((max(entry[1]) for entry in records.values()), default=0.0) / 1000.0
