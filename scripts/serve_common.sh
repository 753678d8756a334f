# Sourced by scripts/serve_engine.sh and scripts/serve_reward_model.sh (not run on its own): start the server
# command CMD as its caller's MODE says, and for the background mode wait until CHECK answers.
#
#   launch_server TAG LOG LIMIT     TAG: the caller's name in messages; LOG: the server's log (background modes);
#                                   LIMIT: seconds to wait for CHECK (background mode)
# Reads the caller's CMD (array), MODE (foreground | background | nowait), CHECK and URL; uses its die().
# CHECK is /health: vLLM and SGLang answer it without the --api-key (vLLM checks /v1 routes only, SGLang every route
# but /health and /metrics), so a server that wants a key is waited for the same way. A key is never in CMD: the
# callers pass it in the environment (VLLM_API_KEY), where `ps` and the echoed command do not show it.

launch_server() {
    local tag="$1" log="$2" limit="$3" i
    if [[ "$MODE" == foreground ]]; then
        exec "${CMD[@]}"
    fi
    setsid "${CMD[@]}" >"$log" 2>&1 </dev/null &
    PID=$!
    echo "$tag: started (pid $PID, process group $PID), log: $log"
    if [[ "$MODE" == background ]]; then
        for ((i = 0; i < limit; i++)); do
            if curl -s -m 2 -o /dev/null -f "$CHECK" 2>/dev/null; then break; fi
            kill -0 "$PID" 2>/dev/null || die "the server exited during start-up; the end of $log: $(tail -n 3 "$log" | tr '\n' ' ')"
            sleep 1
        done
        ((i < limit)) || die "no answer on $URL/health after ${limit}s (still starting? see $log; stop it with kill -- -$PID)"
        echo "$tag: ready at $URL (${i}s)"
    fi
}
