"""What a training step sends between GPUs: DeepSpeed's comms logger around one step.

The logger synchronises the device after every collective, so a logged step is slower than an unlogged one;
each call's own time is still measured from its start to its end (waiting for a slower peer included).
DeepSpeed 0.19 records, at each call, its timer's running total (elapsed(reset=False)), so an op's total time
is its largest record after its timer is reset, not the sum of the records.

The logger sees what goes through `deepspeed.comm`: ZeRO-3's collectives and attention's exchange. The linear
mixers' exchange (sequence_parallel.py) calls torch's all-to-all directly, so for the logged step torch's
`all_to_all_single` is routed through `deepspeed.comm` (`torch_all_to_alls_logged`) and both exchanges are counted
alike, as when the mixers exchanged through DeepSpeed.
"""
from __future__ import annotations

from contextlib import contextmanager


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
        with torch_all_to_alls_logged():
            step()
        return dist.comms_logger.get_raw_data()
    finally:
        dist.configure(enabled=False)


@contextmanager
def torch_all_to_alls_logged():
    """Inside: a call of torch.distributed.all_to_all_single from outside DeepSpeed goes through
    deepspeed.comm.all_to_all_single (logged, then DeepSpeed's backend, then torch's function); DeepSpeed's own
    calls, which reach torch's function from inside its backend, pass straight through (logged once)."""
    import torch.distributed
    import deepspeed.comm as dist
    from deepspeed.comm import comm as comm_module

    torch_all_to_all, backend = torch.distributed.all_to_all_single, comm_module.cdb
    own = vars(backend).get("all_to_all_single")  # an instance attribute: the emulation's wrapper (emulate.py)
    in_backend = []

    def inside_backend(*args, **kwargs):
        in_backend.append(True)
        try:
            return (own or type(backend).all_to_all_single.__get__(backend))(*args, **kwargs)
        finally:
            in_backend.pop()

    def routed(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if in_backend:
            return torch_all_to_all(output, input, output_split_sizes, input_split_sizes, group, async_op)
        return dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                      input_split_sizes=input_split_sizes, group=group, async_op=async_op)

    backend.all_to_all_single, torch.distributed.all_to_all_single = inside_backend, routed
    try:
        yield
    finally:
        torch.distributed.all_to_all_single = torch_all_to_all
        if own is None:
            del backend.all_to_all_single
        else:
            backend.all_to_all_single = own


def call_counts(logged: dict) -> dict:
    """{op: {message bytes: calls}} of logged_collectives' records (what planner/communication.py reads)."""
    return {op: {int(size): entry[0] for size, entry in records.items()} for op, records in logged.items()}


def total_seconds(records: dict) -> float:
    """Seconds of all calls of one op from its records {message bytes: [calls, running totals (ms), ...]}."""
    return max((max(entry[1]) for entry in records.values()), default=0.0) / 1000.0
