# run_or_requeue CMD...: run the training command and stop it the way that keeps its last step. Sourced by the
# batch scripts, and a command of its own for any preemptible or interactive run:
#
#   bash scripts/slurm/run_or_requeue.sh deepspeed --num_gpus 8 scripts/train.py --config ...
#
# A SIGTERM or Ctrl-C (SIGINT) that reaches this shell is passed to the training ranks themselves; they finish the
# step, save a checkpoint and exit 75, their launcher then exits 75 too, and so does this command, only after the
# checkpoint is complete. (Signalling DeepSpeed's launchers instead would end `deepspeed` at once, with its ranks
# still stepping, and its per-node launcher would kill the ranks 30 s later.) Where no rank runs in this process
# tree (srun starts them on the nodes; DeepSpeed's multi-node launcher over pdsh), the command itself gets the
# signal: srun passes it on to its tasks and waits for them. A second Ctrl-C stops the ranks at once.
#
# The command runs in a session of its own, so a Ctrl-C at the terminal reaches this shell only. When it exits 75
# inside a SLURM job the job is requeued, and the requeued job resumes (the batch scripts add --resume-if-present).
# REQUEUE_ON_STOP=0 turns the requeue off.
EXIT_STOPPED=75
RUN_OR_REQUEUE_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

stop_training() {   # stop_training PID TERM|INT
    PYTHONPATH="$RUN_OR_REQUEUE_REPO${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python}" \
        -m ulysses_train.parallel.launch stop-ranks "$1" "$2" || kill "-$2" "$1" 2>/dev/null || true
}

run_or_requeue() {
    local session=()
    if command -v setsid >/dev/null 2>&1; then
        session=(setsid --wait)
    fi
    ${session[@]+"${session[@]}"} "$@" &
    local child=$! rc=0
    trap 'stop_training "$child" TERM' TERM
    trap 'stop_training "$child" INT' INT
    wait "$child" || rc=$?
    # a trapped signal interrupts `wait` (a status > 128); wait again for the command's own status, which bash keeps
    # for an ended child (checking that it still runs before waiting lost the 75 of a command that ended in between)
    while (( rc > 128 )); do
        rc=0
        wait "$child" || rc=$?
        kill -0 "$child" 2>/dev/null || break
    done
    trap - TERM INT
    if (( rc == EXIT_STOPPED )) && [[ "${REQUEUE_ON_STOP:-1}" == 1 && -n "${SLURM_JOB_ID:-}" ]] \
            && command -v scontrol >/dev/null 2>&1; then
        echo "# training stopped cleanly after saving a checkpoint (exit $EXIT_STOPPED): requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    return "$rc"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then   # run as a command, not sourced
    if (( $# == 0 )); then
        echo "usage: bash scripts/slurm/run_or_requeue.sh COMMAND [ARGS...]" >&2
        exit 2
    fi
    rc=0
    run_or_requeue "$@" || rc=$?
    exit "$rc"
fi
