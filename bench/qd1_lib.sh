# Shared by bench/qd1_commit.sh and bench/qd1_read.sh (sourced, not run).

# serve_fresh BIN DIR CACHE BACKING SIZE: formats CACHE over a new sparse BACKING of SIZE, starts
# a write-back server with its sockets and logs in DIR (made afresh), waits for its NBD socket
# ($DIR/s.sock) and sets SERVER_PID.
serve_fresh() {
    local bin=$1 d=$2 cache=$3 backing=$4 size=$5
    rm -rf "$d"; mkdir -p "$d"
    truncate -s "$size" "$backing"
    "$bin" format --cache "$cache" --backing "$backing" --force --no-probe >/dev/null \
        2>"$d/format.err" || { cat "$d/format.err" >&2; exit 1; }
    "$bin" serve --backing "$backing" --cache "$cache" --mode writeback --listen "$d/s.sock" \
        --control-socket "$d/c.sock" --stats-file "$d/stats" >"$d/serve.log" 2>&1 &
    SERVER_PID=$!
    wait_socket "$d/s.sock"
}

# wait_socket PATH: waits up to 10 s for a socket to appear.
wait_socket() {
    for _ in $(seq 100); do [ -S "$1" ] && return; sleep 0.1; done
    echo "no socket $1" >&2; exit 1
}
