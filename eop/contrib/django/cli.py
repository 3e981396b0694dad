"""``manage.py eop ...`` and ``manage.py eop_worker``: eop's commands on the Django project.

One way only: the commands hand eop's command line (:func:`eop.cli.main`) the
project's app (:data:`eop.contrib.django.project.APP_PATH`) and the
environment it reads; eop knows nothing of Django.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from eop import settings as settings_mod
from eop.contrib.django import conf, project

# The commands whose first argument is the app (MODULE:APP); the others take --app,
# whose default is EOP_APP.
_APP_FIRST = ("worker", "status", "audit")

_DATABASE_FLAG = "--database-url"


def argv_for(argv: Sequence[str]) -> list[str]:
    """``eop``'s arguments for ``manage.py eop`` ones: the project's app where one goes."""
    args = list(argv)
    if args and args[0] in _APP_FIRST and not (len(args) > 1 and ":" in args[1]):
        args.insert(1, project.APP_PATH)
    return args


def export_environment() -> None:
    """Put ``settings.EOP`` in the environment, where eop's command line (its log
    flags) and the processes of ``eop worker --processes N`` read their settings;
    point ``EOP_APP`` at the project's app; let those processes import the project."""
    for key, value in conf.eop_dict().items():
        if key in conf.OWN_KEYS or value is None:
            continue
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        os.environ[settings_mod.env_var(key.lower())] = text
    os.environ["EOP_APP"] = project.APP_PATH
    # manage.py's directory is on this process's path (it ran as a script), not on
    # that of `python -m eop` children.
    here = sys.path[0] if sys.path and sys.path[0] else os.getcwd()
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *paths])


def run(argv: Sequence[str]) -> int:
    """Run ``eop <argv>`` on the project; the exit status."""
    from eop import errors
    from eop.cli import main, options

    asked = conf.eop_dict().get("LOG_FORMAT") or os.environ.get("EOP_LOG_FORMAT")
    if any(arg == _DATABASE_FLAG or arg.startswith(f"{_DATABASE_FLAG}=") for arg in argv):
        # The project's database, always: a worker given another one stopped only once
        # connected (an unreachable one was retried for ever), and `eop db` migrated it.
        refused = errors.ConfigurationError(
            f"{_DATABASE_FLAG} is not accepted under Django: eop uses the database of "
            f'DATABASES[{conf.alias()!r}] (settings.EOP["DATABASE"] names the alias); '
            "run manage.py with the settings of the database you mean"
        )
        options.print_error(refused, as_json=asked == "json")
        return 2
    try:
        # Exported as environment variables, an unknown key would be ignored there, and a
        # refused value named as the variable the user never set.
        conf.checked()
    except errors.ConfigurationError as exc:
        options.print_error(exc, as_json=asked == "json")
        return 1
    export_environment()
    host = options.Host(
        prog="manage.py eop",
        settings="settings.EOP",
        app="the project's, settings.EOP['APP']",
        fixed=("database_url",),
    )
    return main(argv_for(argv), host=host)
