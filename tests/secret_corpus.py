"""Generated credentials in the formats agents meet (never real ones): each with the line it appears on.

Seeded, so a failure names the same value every run. Used by ``test_secret_findings.py`` and ``bench/credentials.py``.
"""

from __future__ import annotations

import base64
import json
import random
import string
from dataclasses import dataclass

UPPER_DIGITS = string.ascii_uppercase + string.digits
ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class Planted:
    name: str
    value: str  # what must be found (and never shown)
    line: str  # how it appears: a file line, a URL, an assignment


def _b64url(obj: dict[str, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")


def corpus(seed: int = 0) -> list[Planted]:
    rng = random.Random(seed)

    def r(chars: str, n: int) -> str:
        return "".join(rng.choice(chars) for _ in range(n))

    aws_id = "AKIA" + r(UPPER_DIGITS, 16)
    aws_secret = r(ALNUM + "/+", 40)
    github = "ghp_" + r(ALNUM, 36)
    gitlab = "glpat-" + r(ALNUM, 20)
    slack = f"xoxb-{r(string.digits, 11)}-{r(string.digits, 12)}-{r(ALNUM, 24)}"
    stripe = "sk_live_" + r(ALNUM, 24)
    openai_key = "sk-" + r(ALNUM, 20) + "T3BlbkFJ" + r(ALNUM, 20)
    jwt = _b64url({"alg": "HS256", "typ": "JWT"}) + "." + _b64url({"sub": r(string.digits, 6)}) + "." + r(ALNUM, 43)
    rsa = "\n".join(
        ["-----BEGIN RSA PRIVATE KEY-----", *(r(ALNUM + "+/", 64) for _ in range(6)), "-----END RSA PRIVATE KEY-----"]
    )
    openssh = "\n".join(
        [
            "-----BEGIN OPENSSH PRIVATE KEY-----",
            *(r(ALNUM + "+/", 70) for _ in range(4)),
            "-----END OPENSSH PRIVATE KEY-----",
        ]
    )
    pg_password = r(ALNUM, 16)
    redis_password = r(ALNUM, 20)
    env_password = r(ALNUM, 18)
    env_key = r(string.hexdigits.lower()[:16], 32)
    client_secret = r(ALNUM, 30)
    yaml_password = r(ALNUM, 14) + "!" + r(string.digits, 3)
    return [
        Planted("aws access key", aws_id, f"aws_access_key_id = {aws_id}"),
        Planted("aws secret key", aws_secret, f"aws_secret_access_key = {aws_secret}"),
        Planted("github token", github, f"git remote set-url origin https://{github}@github.com/acme/app.git"),
        Planted("gitlab token", gitlab, f"GITLAB_TOKEN={gitlab}"),
        Planted("slack token", slack, f"SLACK_BOT={slack}"),
        Planted("stripe key", stripe, f"stripe.api_key = '{stripe}'"),
        Planted("openai key", openai_key, f"OPENAI_API_KEY={openai_key}"),
        Planted("jwt", jwt, f"Authorization: Bearer {jwt}"),
        Planted("rsa private key", rsa, rsa),
        Planted("openssh private key", openssh, openssh),
        Planted("postgres url", pg_password, f"DATABASE_URL=postgresql://app:{pg_password}@db.internal:5432/prod"),
        Planted("redis url", redis_password, f"redis://default:{redis_password}@cache:6379/0"),
        Planted("env password", env_password, f"DB_PASSWORD={env_password}"),
        Planted("env api key", env_key, f'export SERVICE_API_KEY="{env_key}"'),
        Planted("json client secret", client_secret, json.dumps({"client_id": "app", "client_secret": client_secret})),
        Planted("yaml password", yaml_password, f"  password: {yaml_password}"),
    ]


# Ordinary code and prose with the words credentials come with: none of it is a credential.
ORDINARY = [
    "password: see the docs for how to reset it",
    "password = get_password(user)",
    'API_KEY = os.environ["API_KEY"]',
    "token: <your token here>",
    "export GITHUB_TOKEN=${GITHUB_TOKEN}",
    "secret_key = settings.SECRET_KEY",
    "if token is None: raise AuthError('missing token')",
    "The private key must never be committed; use `ssh-keygen -t ed25519` to make one.",
    "Set PASSWORD_FILE=/run/secrets/db_password in the compose file.",
    "class PasswordResetForm(forms.Form):",
    "apiKey: process.env.OPENAI_API_KEY,",
    "git clone https://github.com/acme/app.git && cd app && npm ci",
    "postgresql://localhost:5432/test",
    "sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "keyboard: the key binding is ctrl+shift+p",
]
