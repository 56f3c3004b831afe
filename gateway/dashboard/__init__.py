"""The operator console: server-rendered pages at ``/dashboard`` (``routes.py``) with SVG charts (``charts.py``)."""
