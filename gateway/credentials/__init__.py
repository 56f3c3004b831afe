"""Credentials in captured traffic: found on capture (``detect``, ``tokens``), kept out of training, redacted where
text is shown (``redact``)."""
