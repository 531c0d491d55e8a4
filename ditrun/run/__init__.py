"""The run: what one worker does with a config, from its checks to its summary (``worker.run``).

``checks.py`` refuses a config before any work; ``folders.py`` checks every folder the run will write;
``worker.py`` builds the model and layout, runs the edits and writes their records (``records.py``) and the
console table (``console.py``); ``compile_cache.py`` keeps compiled code where the next process finds it;
``warm.py`` is ``ditrun warm``. ``launch/`` starts and coordinates the ranks and runs ``WORK`` on each.
"""

from ditrun.launch.work import Work
from ditrun.run import checks, worker

WORK = Work(check=checks.check_config, run=worker.run)
"""What every rank of a ditrun job does: check the config, then run the worker."""
