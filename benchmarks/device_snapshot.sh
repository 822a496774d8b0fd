#!/usr/bin/env bash
# Before a GPU-machine run while other engineers edit the same tree: write snap.tgz (HEAD's version of every
# file modified but not committed) and snap_untracked.txt (new files to drop), both git-ignored via
# .git/info/exclude. Then, in the device call (carry .site snap.tgz snap_untracked.txt):
#   xargs -r rm -f < snap_untracked.txt; tar xzf snap.tgz; bash benchmarks/device_final.sh a
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/snap.tgz' .git/info/exclude || printf '/snap.tgz\n/snap_untracked.txt\n/.site/\n' >> .git/info/exclude
mods=$(git diff --name-only HEAD)
git ls-files --others --exclude-standard > snap_untracked.txt
if [ -n "$mods" ]; then git archive --format=tar.gz -o snap.tgz HEAD $mods; else tar czf snap.tgz --files-from /dev/null; fi
echo "restores: ${mods:-nothing}"; echo "drops: $(tr '\n' ' ' < snap_untracked.txt)"
