# Sourced by the batch scripts. run_or_requeue CMD...: run the training command, pass SIGTERM/SIGINT that
# reach this batch shell on to it (the trainer then finishes its step, saves a checkpoint and exits 75), and
# when it exits 75 requeue the job, which then resumes (a requeued job gets --resume). REQUEUE_ON_STOP=0
# turns the requeue off.
EXIT_STOPPED=75

run_or_requeue() {
    "$@" &
    local child=$! rc=0
    trap 'kill -TERM "$child" 2>/dev/null' TERM INT
    wait "$child" || rc=$?
    # a trapped signal interrupts `wait`; wait again until the command itself has ended
    while (( rc > 128 )) && kill -0 "$child" 2>/dev/null; do
        rc=0
        wait "$child" || rc=$?
    done
    trap - TERM INT
    if (( rc == EXIT_STOPPED )) && [[ "${REQUEUE_ON_STOP:-1}" == 1 && -n "${SLURM_JOB_ID:-}" ]] \
            && command -v scontrol >/dev/null 2>&1; then
        echo "# training stopped cleanly after saving a checkpoint (exit $EXIT_STOPPED): requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    return "$rc"
}
