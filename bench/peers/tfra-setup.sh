#!/usr/bin/env bash
# Creates a separate virtual environment holding the peer system TFRA (TensorFlow Recommenders-Addons
# 0.8.1, CPU cuckoo hash table) on the newest TensorFlow it supports (2.16.2), for side-by-side benchmarks.
# Usage: bench/peers/tfra-setup.sh [VENV_DIR]   (default: .peer-tfra, git-ignored); `make bench` runs it.
# Peer code runs as VENV_DIR/bin/python in a subprocess (bench/peer_tfra*.py); TFRA is never imported into
# the project's own environment.
set -euo pipefail
venv=${1:-.peer-tfra}
if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c 'import tensorflow_recommenders_addons' 2>/dev/null; then
  echo "peer TFRA ready in $venv"; exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check \
  'tensorflow==2.16.2' 'tf-keras==2.16.0' 'tensorflow-recommenders-addons==0.8.1'
"$venv/bin/python" -c 'import tensorflow_recommenders_addons as t; print("peer TFRA", t.__version__, "ready in '"$venv"'")' 2>/dev/null
