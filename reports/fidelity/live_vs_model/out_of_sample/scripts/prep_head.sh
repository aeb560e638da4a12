#!/bin/bash
# The device copy gets the working tree; restore HEAD's cdbench/ there: HEAD's version of every file
# that differs, and the list of untracked files under cdbench/ to remove.
cd /work/main
git rev-parse HEAD > .cache/oos/head_commit.txt
rm -f .cache/oos/head_overlay.tar
files=$(git diff --name-only HEAD -- cdbench | while read f; do git cat-file -e HEAD:"$f" 2>/dev/null && echo "$f"; done)
if [ -n "$files" ]; then git archive -o .cache/oos/head_overlay.tar HEAD $files; else tar cf .cache/oos/head_overlay.tar -T /dev/null; fi
{ git ls-files -o --exclude-standard -- cdbench; git diff --name-only --diff-filter=A HEAD -- cdbench; } > .cache/oos/head_remove.txt
echo "HEAD $(cat .cache/oos/head_commit.txt); restore: $files; remove: $(cat .cache/oos/head_remove.txt | tr '\n' ' ')"
