#!/bin/bash
# inbranch.sh B cmd...: run cmd from .gpucache/B (a git archive of branch B) with its own lrdsl cache
b=$1; shift; cd .gpucache/$b && export XDG_CACHE_HOME=/tmp/xdg_$b PYTHONPATH=/tmp/site:$PWD && exec "$@"
