#!/usr/bin/env bash
# Sourced by both batch scripts: compile the run's GPU kernels once per node before the ranks start
# (scripts/warm_kernels.py; docs/install.md). One task per node runs it; on a shared kernel cache
# (ULYSSES_TRAIN_KERNEL_CACHE) the nodes take its file lock in turn and the first fills it for all.
# WARM_KERNELS=0 skips it. Only the run's --config and --set arguments are passed on.

warm_kernels_command() {   # ARGS... -> WARM (array); empty without --config
    WARM=()
    local keep=() expect=""
    for arg in "$@"; do
        if [[ -n "$expect" ]]; then keep+=("$expect" "$arg"); expect=""; continue; fi
        case "$arg" in --config|--set) expect="$arg" ;; --config=*|--set=*) keep+=("$arg") ;; esac
    done
    [[ "${WARM_KERNELS:-1}" == 0 || " ${keep[*]-} " != *"--config"* ]] && return 0
    WARM=(srun --nodes="${NUM_NODES:-${SLURM_JOB_NUM_NODES:-1}}" --ntasks-per-node=1 --kill-on-bad-exit=1 "$PYTHON" -u scripts/warm_kernels.py
          "${keep[@]}")
}
