#!/usr/bin/env bash
# Make Debian's Chromium available for the browser test (tests/test_browser.py), which
# drives JupyterLab through Playwright. Playwright cannot download its own browsers
# here, so the test uses the system's /usr/bin/chromium. Called by the test command
# (README, .ci/run) before pytest; installs only when it is missing, with apt-get, as
# root. Where that is impossible it says so and exits 0: the browser test then skips
# with the same note.
set -u
for b in chromium chromium-browser; do
  if command -v "$b" >/dev/null 2>&1; then exit 0; fi
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "ensure-chromium: installing Debian's chromium for the browser test (apt-get)..."
  if apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; then
    echo "ensure-chromium: $(command -v chromium)"
    exit 0
  fi
  echo "ensure-chromium: apt-get could not install chromium; the browser test will be skipped"
  exit 0
fi
echo "ensure-chromium: no chromium and no root apt-get here; the browser test will be skipped" \
     "(install chromium, then run pytest tests/test_browser.py)"
exit 0
