"""Credentials in text: where they are and what kind, never what they are.

The provider formats (AWS, GitHub, GitLab, Slack, Stripe, OpenAI, npm, PyPI, JWT, …) are the patterns of
detect-secrets's maintained plugins, read from the plugin classes so a newer detect-secrets brings its new formats.
detect-secrets itself scans line by line through every plugin, about 10 ms for a 4k-token text on one core; the
gateway scans every call, so its patterns are run here over the whole text at once, and three of its detectors are
shaped for text that is not a source file:

- a private key is the whole PEM block, BEGIN to END (the plugin flags only the header line);
- a password in a URL (``scheme://user:password@host``) is the password alone;
- a value assigned to a key-like name (``API_KEY=…``, ``"password": "…"``, ``secret: …``) counts only when it
  looks like a credential: long enough, not a placeholder or a reference, and with enough entropy (detect-secrets's
  keyword plugin flags any word after ``password``, so prose such as "password: see the docs" would be a finding).

``scan(text)`` is pure and returns character spans; ``tokens.py`` maps them to tokens, ``redact.py`` hides them.
"""

from __future__ import annotations

import itertools
import math
import re
import re._constants as sre_constants
import re._parser as sre_parser
from collections import Counter
from dataclasses import dataclass
from typing import Any

from detect_secrets.plugins import (
    artifactory,
    aws,
    azure_storage_key,
    basic_auth,
    discord,
    github_token,
    gitlab_token,
    jwt,
    mailchimp,
    npm,
    openai,
    private_key,
    pypi_token,
    sendgrid,
    slack,
    square_oauth,
    stripe,
    telegram_token,
    twilio,
)

# Formats whose match is the credential itself. Left out: IP addresses (not credentials), and the plugins whose
# patterns are a keyword followed by any word (Cloudant, IBM Cloud IAM and COS, SoftLayer): the assignment rule
# below covers those names with an entropy check.
_FORMAT_PLUGINS: tuple[Any, ...] = (
    artifactory.ArtifactoryDetector,
    aws.AWSKeyDetector,
    azure_storage_key.AzureStorageKeyDetector,
    discord.DiscordBotTokenDetector,
    github_token.GitHubTokenDetector,
    gitlab_token.GitLabTokenDetector,
    mailchimp.MailchimpDetector,
    npm.NpmDetector,
    openai.OpenAIDetector,
    pypi_token.PypiTokenDetector,
    sendgrid.SendGridDetector,
    slack.SlackDetector,
    square_oauth.SquareOAuthDetector,
    stripe.StripeDetector,
    telegram_token.TelegramBotTokenDetector,
    twilio.TwilioKeyDetector,
)

KINDS: tuple[str, ...] = (
    *(plugin.secret_type for plugin in _FORMAT_PLUGINS),
    jwt.JwtTokenDetector.secret_type,
    private_key.PrivateKeyDetector.secret_type,
    basic_auth.BasicAuthDetector.secret_type,
    "Secret Assignment",
)


@dataclass(frozen=True, slots=True)
class Finding:
    """A credential at ``text[start:end]``, of a kind named as detect-secrets names it."""

    kind: str
    start: int
    end: int


def _starts(items: Any, limit: int = 32) -> list[str]:
    """The literal strings a match of the parsed ``items`` can begin with (as far as they are literal), or [""]."""
    out = [""]
    for op, value in items:
        if op is sre_constants.LITERAL:
            options = [chr(value)]
        elif op is sre_constants.IN and all(o is sre_constants.LITERAL for o, _ in value) and len(value) <= 8:
            options = [chr(v) for _, v in value]
        elif op is sre_constants.SUBPATTERN:
            options = _starts(value[-1], limit)
        elif op is sre_constants.BRANCH:
            options = [start for branch in value[1] for start in _starts(branch, limit)]
        else:
            return out
        if "" in options or len(out) * len(options) > limit:
            return (
                [a + b for a in out for b in options] if "" not in options and len(out) * len(options) <= limit else out
            )
        out = [a + b for a in out for b in options]
    return out


def _required(pattern: re.Pattern[str]) -> tuple[str, ...] | None:
    """Strings one of which every match contains (None: no such hint), read from the parsed pattern: its longest
    run of literal characters, or the literal starts of its matches (``(ghp|gho)_…``, ``(?:AKIA|ASIA)…``). Most
    texts hold none of them, and ``in`` finds that far faster than the pattern itself."""
    if pattern.flags & re.IGNORECASE:
        return None
    items = list(sre_parser.parse(pattern.pattern, pattern.flags))
    runs: list[str] = []
    run: list[str] = []
    for op, value in [*items, (None, None)]:
        if op is sre_constants.LITERAL:
            run.append(chr(value))
        elif run:
            runs.append("".join(run))
            run = []
    longest = max(runs, key=len) if runs else ""
    starts = _starts(items)
    if min(len(s) for s in starts) >= max(len(longest), 2):
        return tuple(sorted(set(starts)))
    return (longest,) if len(longest) >= 2 else None


def _formats() -> list[tuple[str, re.Pattern[str], tuple[str, ...] | None]]:
    return [
        (plugin.secret_type, pattern, _required(pattern)) for plugin in _FORMAT_PLUGINS for pattern in plugin.denylist
    ]


_FORMATS = _formats()
# Every format above is a run of at least 16 of these characters, with at most a few dozen characters of context
# before it (``aws_secret_access_key = …``). The formats are run over those windows only: about a fifth of ordinary
# text, and a third of the time of running them over all of it.
_LONG_RUN = re.compile(r"[A-Za-z0-9_\-+/=.:]{16,}")
_BEFORE, _AFTER = 40, 4
_JWT = jwt.JwtTokenDetector.denylist[0]
_PEM_BEGIN = re.compile(
    r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|PuTTY-User-Key-File-\d",
)
_PEM_END = re.compile(r"-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")
_URL_PASSWORD = basic_auth.BasicAuthDetector.denylist[0]

# The names detect-secrets's keyword plugin treats as holding a secret (api_key, password, passwd, pwd, secret, …)
# and a few more, found by their stems on the lower-cased text (a case-insensitive alternation costs ten times more).
_NAME_STEM = re.compile(r"pass|pwd|secret|key|token|cred")
_ASSIGNMENT = re.compile(
    r"""(?x)
    [A-Za-z0-9_.\-]*                         # the rest of the key-like name
    ["'`]?\]?\s*(?::=|=>|==|=|:)\s*          # assigned
    (?P<quote>["'`]?)
    (?P<value>[^\s"'`,;(){}<>\[\]]{8,})     # a value without spaces or markup
    (?P=quote)
    """
)
_PLACEHOLDER = re.compile(
    r"(?ix)^(?:\$|%|\{|<|\*{3}|x{4}|\.{3}|your[_-]|my[_-]|example|changeme|placeholder|redacted|none$|null$|true$|"
    r"false$|undefined$|env\.|process\.env|os\.environ|self\.|settings\.|config\.)"
)


_TOKEN_TAIL = re.compile(r"[A-Za-z0-9_\-+/=]*")


def _value_span(match: re.Match[str]) -> tuple[int, int]:
    """The credential's span in a format's match: its last group where that ends the match (``name = (value)``),
    else the whole match (a group that is only a prefix, as in ``(ghp|gho)_…``)."""
    for group in range(match.re.groups, 0, -1):
        if match.group(group) and match.end(group) == match.end():
            return match.span(group)
    return match.span()


def _entropy(value: str) -> float:
    counts = Counter(value)
    n = len(value)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def _looks_secret(value: str) -> bool:
    """A value after a key-like name that is a credential, not a word, a path, a reference or a placeholder."""
    if _PLACEHOLDER.match(value) or value.count("/") > 1 or value.startswith(("http", "./", "~")):
        return False
    if value.replace("_", "").replace("-", "").replace(".", "").isalpha():
        # Letters only: a word or an identifier (get_password, PASSWORD_FILE, PasswordResetForm) unless the case
        # changes as often as in random text (a camel-case identifier changes it about once a word).
        changes = sum(a.isupper() != b.isupper() for a, b in itertools.pairwise(value))
        return len(value) >= 12 and changes * 3 >= len(value) and _entropy(value) >= 3.0
    has_digit = any(c.isdigit() for c in value)
    has_letter = any(c.isalpha() for c in value)
    return has_digit and has_letter and _entropy(value) >= 3.0


def scan(text: str) -> list[Finding]:
    """Every credential in ``text``, in order; overlapping findings are merged into the earliest kind's span."""
    return _merged([*_private_keys(text), *_url_passwords(text), *_formats_in(text), *_assignments(text)])


def _private_keys(text: str) -> list[Finding]:
    kind = private_key.PrivateKeyDetector.secret_type
    out = []
    for begin in _PEM_BEGIN.finditer(text):
        block_end = _PEM_END.search(text, begin.end())
        out.append(Finding(kind, begin.start(), block_end.end() if block_end else len(text)))
    return out


def _url_passwords(text: str) -> list[Finding]:
    kind = basic_auth.BasicAuthDetector.secret_type
    return [Finding(kind, m.start(1), m.end(1)) for m in _URL_PASSWORD.finditer(text)]


def _formats_in(text: str) -> list[Finding]:
    out = []
    formats = [(k, p, hint) for k, p, hint in _FORMATS if hint is None or any(h in text for h in hint)]
    for lo, hi in _windows(text):
        window = text[lo:hi]
        for kind, pattern, hint in formats:
            if hint is not None and not any(h in window for h in hint):
                continue
            for match in pattern.finditer(window):
                start, end = _value_span(match)
                out.append(Finding(kind, lo + start, lo + end))
        for match in _JWT.finditer(window):
            if jwt.JwtTokenDetector.is_formally_valid(match.group()):
                # The plugin's pattern ends lazily before the signature: the token runs on to its last character.
                tail = _TOKEN_TAIL.match(text, lo + match.end())
                token_end = tail.end() if tail else lo + match.end()
                out.append(Finding(jwt.JwtTokenDetector.secret_type, lo + match.start(), token_end))
    return out


def _assignments(text: str) -> list[Finding]:
    lowered = text.lower()
    if len(lowered) != len(text):  # a few non-ASCII letters lower-case to two characters
        lowered = "".join(c.lower() if c.isascii() else c for c in text)
    out = []
    for stem in _NAME_STEM.finditer(lowered):
        match = _ASSIGNMENT.match(text, stem.end())
        if match is not None and _looks_secret(match.group("value")):
            out.append(Finding("Secret Assignment", *match.span("value")))
    return out


def _windows(text: str) -> list[tuple[int, int]]:
    """The stretches of ``text`` a format can match in: each long token run with its context, overlaps merged."""
    spans: list[tuple[int, int]] = []
    for run in _LONG_RUN.finditer(text):
        lo, hi = max(0, run.start() - _BEFORE), min(len(text), run.end() + _AFTER)
        if spans and lo <= spans[-1][1]:
            spans[-1] = (spans[-1][0], hi)
        else:
            spans.append((lo, hi))
    return spans


def _merged(found: list[Finding]) -> list[Finding]:
    out: list[Finding] = []
    for f in sorted(found, key=lambda f: (f.start, -f.end)):
        if out and f.start < out[-1].end:
            last = out[-1]
            out[-1] = Finding(last.kind, last.start, max(last.end, f.end))
        else:
            out.append(f)
    return out
