#!/usr/bin/env bash
# System packages Tandem wants, where the system can give them. Safe to rerun.
set -euo pipefail
if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  if ! ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq libopenblas0-pthread
  fi
fi
