#!/usr/bin/env bash
# What `tandem service` does on a real Mac (launchd cannot run on the Linux CI box, where its
# calls are checked against a double): install a LaunchAgent, wait for /health, kill the router
# and check a request made meanwhile is answered (the supervisor keeps the port), kickstart -k,
# kill the whole server and check launchd brings it back (KeepAlive), SIGTERM (it stays stopped:
# exit 0), stop, start, logs, status, uninstall. Then the same with --socket-activation (launchd holds
# the port: a request made during `tandem service restart` is answered, not refused).
#
#   bash benchmarks/probes/mac_service.sh [PORT] [-- serve flags, e.g. --model mlx-community/...]
#
# Run it as the logged-in user (a gui/$UID domain), from the environment `tandem` is installed
# in (TANDEM=/path/to/tandem to pick one); macOS's own bash 3.2 runs it. It uses the label dev.tandem.check and removes it at
# the end, whatever happened. Each check prints PASS or FAIL; the exit code is the FAIL count.
set -u
port=8765
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then port=$1; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi
serve_flags=("$@")
tandem=${TANDEM:-tandem}
label=dev.tandem.check
target="gui/$(id -u)/$label"
plist="$HOME/Library/LaunchAgents/$label.plist"
url="http://127.0.0.1:$port"
failures=0

check() {  # check NAME COMMAND...: PASS when the command succeeds
  local name=$1; shift
  if "$@"; then echo "PASS  $name"; else echo "FAIL  $name"; failures=$((failures + 1)); fi
}
healthy() {  # healthy SECONDS: /health answers 200 within them
  local deadline=$((SECONDS + $1))
  while [ $SECONDS -lt $deadline ]; do
    [ "$(curl -s -o /dev/null -m 3 -w '%{http_code}' "$url/health")" = 200 ] && return 0
    sleep 1
  done
  return 1
}
job_pid() { launchctl print "$target" 2>/dev/null | awk -F' = ' '/^\tpid = /{print $2}'; }
job_state() { launchctl print "$target" 2>/dev/null | awk -F' = ' '/^\tstate = /{print $2}'; }
router_pid() {  # the process besides the supervisor holding the listening socket
  local sup; sup=$(job_pid)
  lsof -nP -iTCP:"$port" -sTCP:LISTEN -t 2>/dev/null | grep -vx -e "${sup:-none}" -e 1 | head -1
}
ask() {  # one short chat completion; prints the HTTP status (000: refused or no answer)
  curl -s -o /dev/null -m 180 -w '%{http_code}' "$url/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model":"default","messages":[{"role":"user","content":"Say hi."}],"max_tokens":4}'
}
cleanup() { "$tandem" service uninstall --label "$label" >/dev/null 2>&1; }
trap cleanup EXIT

run_round() {  # run_round NAME [install flags]
  local round=$1; shift
  echo "== $round"
  cleanup
  check "$round: install" "$tandem" service install --label "$label" "$@" --port "$port" -- ${serve_flags[@]+"${serve_flags[@]}"}  # bash 3.2
  check "$round: the plist is valid (plutil -lint)" plutil -lint "$plist"
  check "$round: healthy within 300 s" healthy 300
  check "$round: launchd says running" test "$(job_state)" = running
  check "$round: status exits 0" "$tandem" service status --label "$label"

  local router; router=$(router_pid)
  check "$round: the router holds the supervisor's socket" test -n "$router"
  if [ -n "$router" ]; then
    kill -9 "$router"
    check "$round: a request made while the router is down is answered" test "$(ask)" = 200
    local again; again=$(router_pid)
    check "$round: a new router serves" test -n "$again" -a "$again" != "$router"
  fi

  local sup; sup=$(job_pid)
  if [ "$round" = socket-activation ]; then
    "$tandem" service restart --label "$label" &
    sleep 1
    check "$round: a request made during kickstart -k is answered (launchd holds the port)" test "$(ask)" = 200
    wait
  else
    check "$round: restart (kickstart -k)" "$tandem" service restart --label "$label"
    check "$round: healthy after restart" healthy 300
  fi
  check "$round: a new supervisor after restart" test "$(job_pid)" != "$sup"

  sup=$(job_pid)
  kill -9 "$sup"
  check "$round: launchd restarts a killed server (KeepAlive)" healthy 300
  check "$round: ... as a new process" test "$(job_pid)" != "$sup"

  if [ "$round" = plain ]; then  # exit 0 after SIGTERM: KeepAlive {SuccessfulExit: false} leaves it stopped
    kill -TERM "$(job_pid)"
    sleep 20  # past ThrottleInterval: KeepAlive would have restarted a failure by now
    check "$round: a server stopped by SIGTERM stays stopped" test "$(job_state)" != running
    check "$round: launchd saw exit code 0" sh -c "launchctl print '$target' | grep -q 'last exit code = 0'"
  fi
  check "$round: stop (bootout)" "$tandem" service stop --label "$label"
  check "$round: stopped" sh -c "! launchctl print '$target' >/dev/null 2>&1"
  check "$round: status exits 3 when stopped" sh -c "'$tandem' service status --label '$label' >/dev/null; test \$? = 3"
  check "$round: start" "$tandem" service start --label "$label"
  check "$round: healthy after start" healthy 300
  check "$round: logs has lines" sh -c "'$tandem' service logs --label '$label' -n 5 | grep -q ."
  check "$round: ProcessType Interactive in launchd" sh -c "launchctl print '$target' | grep -qi 'interactive'"

  check "$round: uninstall" "$tandem" service uninstall --label "$label"
  check "$round: the plist is gone" test ! -e "$plist"
  check "$round: launchd forgot it" sh -c "! launchctl print '$target' >/dev/null 2>&1"
  check "$round: the port is closed" sh -c "! curl -s -m 3 '$url/health' >/dev/null"
}

run_round plain
run_round socket-activation --socket-activation
echo "$failures failed"
exit "$failures"
