# Sourced by the GPU scripts: installs the wheels carried in .whl/ into /tmp/site (outside the repository copy,
# which is synced again each call) once per machine, and puts it and the repository on PYTHONPATH. The wheels'
# names are kept in /tmp/site/.wheels once installed: a command started while another of the same wheels runs (two
# trainings side by side, the second started after the first's install) leaves the installed packages alone rather
# than replacing the files the other imports from.
if ls .whl/*.whl >/dev/null 2>&1; then
  wheels=$(cd .whl && ls -- *.whl | sort | tr '\n' ' ')
  if [[ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$wheels" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && echo "$wheels" >/tmp/site/.wheels
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
