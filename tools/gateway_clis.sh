#!/usr/bin/env bash
# Install the agent CLIs the gateway end-to-end tests drive (Claude Code and
# Codex) once per machine, into a cache folder outside the repository: they
# are large (about 650 MB together) and must never land in the checkout.
#
# Usage: tools/gateway_clis.sh [DIR]    (default: $AGENTLOG_CLI_DIR or ~/.cache/agentlog-clis)
# Prints the bin folder on success. Idempotent: a second run is a no-op.
# Versions are pinned to the ones the end-to-end tests were written against
# (override with CLAUDE_CODE_VERSION / CODEX_VERSION).
set -euo pipefail
DIR="${1:-${AGENTLOG_CLI_DIR:-$HOME/.cache/agentlog-clis}}"
BIN="$DIR/node_modules/.bin"
if [[ -x "$BIN/claude" && -x "$BIN/codex" ]]; then
    echo "$BIN"
    exit 0
fi
command -v npm >/dev/null || { echo "gateway_clis.sh: npm not found; install node to run the CLI end-to-end tests" >&2; exit 2; }
mkdir -p "$DIR"
# A lock so concurrent test runs on one machine do not install twice.
exec 9>"$DIR/.install.lock"
flock 9
if [[ ! -x "$BIN/claude" || ! -x "$BIN/codex" ]]; then
    # A short fetch timeout: with no registry reachable, fail in about a minute, not 15.
    npm install --prefix "$DIR" --no-audit --no-fund --loglevel=error --fetch-timeout=60000 --fetch-retries=1 \
        "@anthropic-ai/claude-code@${CLAUDE_CODE_VERSION:-2.1.197}" "@openai/codex@${CODEX_VERSION:-0.171.0}" >&2
fi
echo "$BIN"
