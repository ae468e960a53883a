"""The prediction store (docs/store.md): what the server answered, and the true labels that come back for it.

A server room beside ``service.api`` and ``service.runtime``; it imports the core library and the settings only.
SQLite by default (a file under ``HYDRA_STATE_DIR``), PostgreSQL when ``HYDRA_STORE_URL`` names one, through the
same SQLAlchemy Core code; ``HYDRA_STORE=off`` turns it off.

* :mod:`.store`: :class:`PredictionStore`, the one object the server holds, and :func:`open_store`;
* :mod:`.writer`: the background thread that writes predictions in batches, off the event loop;
* :mod:`.feedback`: true labels matched to their predictions, one status per item;
* :mod:`.reads`: the rows and counts the live statistics read;
* :mod:`.state`: shared online state by compare-and-set;
* :mod:`.writes`: insert and retention statements; :mod:`.schema`: the tables; :mod:`.database`: engines and
  transactions; :mod:`.records`: the records in and out; :mod:`.errors`: the exceptions.
"""

from service.store import records
from service.store.records import *  # noqa: F403 (records.__all__ lists the records, re-exported whole)
from service.store.store import PredictionStore, StoreConfig, open_store
from service.store.store_errors import StateConflict, StoreError, StoreUnavailable

__all__ = ["PredictionStore", "StateConflict", "StoreConfig", "StoreError", "StoreUnavailable", "open_store"]
__all__ += records.__all__
