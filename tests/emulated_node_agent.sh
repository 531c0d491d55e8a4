#!/bin/sh
# A stand-in for ssh that "logs in" to an emulated node of tests/nodes.py: Open MPI (or any
# launcher with an rsh/ssh agent setting) calls it as `agent [options] HOST COMMAND...`; it runs
# COMMAND here, in a UTS namespace of its own whose host name is HOST. Options are ignored.
while [ $# -gt 0 ]; do
    case "$1" in -*) shift ;; *) break ;; esac
done
host=$1
shift
# ssh runs its arguments as one shell command line; so does this.
exec unshare --uts sh -c 'hostname "$1" && shift && exec sh -c "$*"' sh "$host" "$@"
