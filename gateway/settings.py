"""Process settings: one pydantic-settings class, every field also an env var ``CLAWGATE_<NAME>``.

Nothing else in the project reads the environment; the CLI builds a ``Settings`` from env and flags and passes it
down.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_DATA_DIR = Path(".clawgate")
PLACEHOLDER_SECRETS = {"changeme", "change-me", "secret", "admin", "password", "sk-xxx", ""}


def _split_csv(value: object) -> object:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CLAWGATE_", extra="ignore")

    environment: Literal["development", "production"] = "development"

    # Serving
    host: str = "127.0.0.1"
    port: int = 8080
    # Gateway processes serving the port (uvicorn workers); they share the database like gateways on several hosts.
    workers: int = Field(default=1, ge=1)
    engine: Literal["local", "vllm"] = "local"
    # A local folder or a hub id; the tokenizer and chat template always come from it.
    model: str = str(DEFAULT_DATA_DIR / "tiny-model")
    # Name clients send as `model`; defaults to the model folder's name.
    served_model_name: str | None = None
    # Extra names accepted as `model` (harnesses often send their own model names); "*" accepts any name.
    model_aliases: Annotated[list[str], NoDecode] = Field(default_factory=list)
    vllm_url: str = "http://127.0.0.1:8000"
    # The base model's name on the vLLM server (defaults to `model`).
    vllm_model: str | None = None
    # Interpreter of a vLLM install (for `--engine vllm` started by clawgate, and for tests).
    vllm_python: str | None = None
    vllm_timeout: float = 600.0
    # Several vLLM replicas behind a router (`vllm_url` then points at the router): their own base URLs, to which
    # the gateway sends what must reach every replica (adapter loads and unloads, aborts). Empty: one server.
    vllm_replicas: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # vLLM streams the first token at once, then every `vllm_stream_interval` tokens (its `stream_interval`): each
    # streamed chunk costs the gateway a read and a socket write however few tokens it holds, so a larger interval
    # divides the per-token CPU of streamed answers (and vLLM's own) at the price of chunkier streams. 1: every token.
    vllm_stream_interval: int = Field(default=1, ge=1)
    local_dtype: Literal["float32", "bfloat16"] = "float32"
    # Tool-call/reasoning parser family for the model's output.
    parser: str = "hermes"
    # Server-side generation cap: a request asking for more gets at most this many tokens. None: what the client
    # asks for, up to the model's context minus the prompt (a cap cuts answers short, and a harness such as Claude
    # Code treats an answer cut at its `max_tokens` as an error).
    max_tokens: int | None = Field(default=None, ge=1)
    # Calls generating at once, over all APIs; more are refused with a 503 and Retry-After before reaching the
    # engine (0: no limit).
    max_concurrent_calls: int = Field(default=1024, ge=0)

    # Policy versions (policy@vN): where the trainer writes them, and how the gateway follows them.
    adapter_dir: Path = Path("adapters")
    # Serve the newest published version (loaded into the engine, verified, then routed to); off: base model only.
    policy_follow: bool = True
    # How often the gateway looks for a newly published version (seconds): the bound on swap delay.
    policy_poll_interval: float = Field(default=1.0, gt=0)
    # Versions kept loaded in the engine (the current one and the newest older ones, for in-flight calls).
    policy_keep_loaded: int = Field(default=3, ge=1)
    # Several gateways on one engine: each reports the adapters it serves or runs calls on this often (seconds); a
    # version is unloaded only when no gateway reported it within the lease (a silent gateway's reports expire).
    adapter_heartbeat_interval: float = Field(default=5.0, gt=0)
    adapter_lease_seconds: float = Field(default=30.0, gt=0)
    # The adapter directory as the vLLM server sees it (compose mounts one volume at the same path everywhere).
    vllm_adapter_dir: Path | None = None

    # Guarded promotion (gateway/promotion): "guarded" serves a newly trained version to a canary share of new
    # conversations beside the incumbent and promotes or rejects it on live evidence; "immediate" serves it to all
    # traffic at once. Default: guarded in production (a bad step must not reach every user), immediate in
    # development (one person's traffic gives a canary little evidence, and a demo should show learning at once).
    # Every gateway on one database must use the same mode (each records it there; the trainer reads it).
    promotion: Literal["guarded", "immediate"] | None = None
    # Share of new conversations the candidate serves during its canary.
    canary_share: float = Field(default=0.1, gt=0, le=1)
    # Rewarded samples (turns, task runs) each arm needs before the canary is decided on evidence.
    canary_min_turns: int = Field(default=50, ge=1)
    # How much lower (in reward units) the candidate's mean reward may be and still be promoted.
    promotion_margin: float = Field(default=0.05, ge=0)
    # A canary undecided this long (seconds) gets `canary_timeout_outcome` (reject: unproven weights serve nobody).
    canary_max_seconds: float = Field(default=3600.0, gt=0)
    canary_timeout_outcome: Literal["promote", "reject"] = "reject"
    # Seconds between looks at a running canary's evidence (each gateway looks; the first to decide decides).
    canary_check_interval: float = Field(default=5.0, gt=0)
    # The evaluation gate (trainer/eval_gate.py), under guarded promotion: a held-out task file (JSONL, verifiers
    # as for `clawgate rollout`) the trainer runs on each new version and on the incumbent, through the gateway at
    # `gateway_url`, before the version may start its canary. Off when unset.
    eval_gate_tasks: Path | None = None
    eval_gate_harness: str = "builtin"  # comma-separated harness names
    eval_gate_n: int = Field(default=1, ge=1)  # rollouts per task × harness and arm

    # Trainer (`clawgate train`, `clawgate up`)
    train_algorithm: Literal["grpo", "ppo"] = "grpo"
    # 0 makes a control run: versions are published and served, the weights never change.
    train_lr: float = Field(default=1e-5, ge=0)
    # A step starts when this many rollouts are ready and they span at least `train_min_groups` usable groups.
    train_min_rollouts: int = Field(default=8, ge=1)
    train_min_groups: int = Field(default=1, ge=0)
    # Seconds between looks at the store when nothing is ready.
    train_interval: float = Field(default=5.0, gt=0)
    train_max_rollouts: int = Field(default=256, ge=1)
    # Turns of everyday traffic per step at most; a turn whose counterfactual group was scored counts its answers
    # (itself and its scored siblings), as for train_min_turns: what a step trains, and costs.
    train_max_turns: int = Field(default=256, ge=1)
    # Tokens per packed micro-batch (one forward pass); under torchrun micro-batches are shared out between ranks.
    train_max_tokens_per_bin: int = Field(default=16384, ge=16)
    # Rollouts served by a version more than this many versions older than the trained one are not trained on.
    train_max_staleness: int = Field(default=8, ge=0)
    # A group with a single ready rollout waits this long for company before it is consumed without signal.
    train_group_wait: float = Field(default=600.0, ge=0)
    # Temperature the rollouts were sampled at (engines report logprobs of the processed distribution).
    train_temperature: float = Field(default=1.0, gt=0)
    train_device: str = "auto"
    # torch's CPU threads in the trainer (default: torch's own, one per core). On a machine whose cores the trainer
    # shares with a CPU vLLM, fewer threads than cores keep its parallel regions from waiting on a preempted thread.
    train_threads: int | None = Field(default=None, ge=1)
    train_dtype: Literal["float32", "bfloat16"] = "float32"
    train_gradient_checkpointing: bool = False
    # Under torchrun: shard the frozen base over the ranks (FSDP2), and compute a sharded base in bfloat16 ("bf16").
    train_shard: bool = False
    train_mixed_precision: Literal["no", "bf16"] = "no"
    train_lora_rank: int = Field(default=8, ge=1)
    train_lora_alpha: int = Field(default=16, ge=1)
    train_seed: int = 0
    # Advantages: "group" (GRPO within a rollout's task–harness group; rollouts without a group, i.e. everyday
    # traffic, are trained turn by turn against a batch baseline), "batch" (everything against a batch baseline
    # per harness), "critic" (PPO's value head: the same as train_algorithm=ppo).
    train_advantage: Literal["group", "batch", "critic"] = "group"
    # A step starts when this many turns (calls of rollouts without a group) are ready, like train_min_rollouts; a turn
    # whose counterfactual group was scored counts its answers (itself and its scored siblings).
    train_min_turns: int = Field(default=16, ge=1)
    # Turns wait for the reward worker's verdict before they are trained (default: when a judge or a reward
    # function is configured, so a turn is never trained before its judge score exists).
    train_await_judge: bool | None = None
    # Training metrics: the trainer's own Prometheus /metrics port (None: not served), and optional loggers
    # ("tensorboard", "wandb", comma-separated) writing under train_log_dir (default <data_dir>/runs).
    train_metrics_port: int | None = Field(default=None, ge=1, le=65535)
    train_log_to: str | None = None
    train_log_dir: Path | None = None

    # Rewards for turns of everyday traffic (`clawgate judge`, started by `clawgate up` when configured).
    # An LLM judge reached through LiteLLM: any model string it knows ("openai/gpt-4o-mini", "anthropic/…",
    # "hosted_vllm/NAME" with judge_api_base, …).
    judge_model: str | None = None
    judge_api_base: str | None = None
    # The name of the environment variable that holds the judge's API key (its value is never logged).
    judge_api_key_env: str | None = None
    # A file with the rubric (the judge's instructions); the built-in one is for agent work.
    judge_rubric: Path | None = None
    judge_concurrency: int = Field(default=4, ge=1)
    # Seconds one judge call may take before it counts as failed (and is retried).
    judge_timeout: float = Field(default=60.0, gt=0)
    # Attempts at a turn whose answers cannot be parsed (or that the judge refuses) before it is given up on.
    judge_max_attempts: int = Field(default=3, ge=1)
    # Tokens of the conversation before the reply, of the reply and of the next state shown to the judge (the
    # start and the end of a longer text are kept).
    judge_context_tokens: int = Field(default=1536, ge=0)
    judge_reply_tokens: int = Field(default=1024, ge=16)
    judge_next_state_tokens: int = Field(default=1024, ge=16)
    judge_max_answer_tokens: int = Field(default=256, ge=16)
    judge_temperature: float = Field(default=0.0, ge=0)
    # Seconds between the reward worker's looks for turns to judge when it found none.
    judge_interval: float = Field(default=1.0, gt=0)
    # Python reward functions `module:function`, called once per turn with its reply and next state.
    reward_functions: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Next-state rule: the reward of a turn whose tool results report a failure (0 turns the rule off).
    tool_error_reward: float = -1.0
    # Counterfactual groups (``gateway/core/counterfactuals.py``): for this share of served everyday turns, draw this
    # many more answers to the same prompt ids off the critical path, so the turn trains in a group (0: off).
    counterfactuals: int = Field(default=0, ge=0, le=64)
    counterfactual_share: float = Field(default=1.0, ge=0, le=1)
    # Groups being drawn or waiting at once; a turn offered beyond this is not drawn for (counted as dropped).
    counterfactual_max_pending: int = Field(default=4, ge=1)
    # The vLLM request priority of a sibling (larger: later), for a vLLM server started with
    # `--scheduling-policy priority`; 0 (vLLM refuses any other value under its default FCFS policy): the gateway
    # itself yields, drawing only while no live call runs and abandoning a draw when one arrives.
    counterfactual_priority: int = Field(default=0, ge=0)

    # Store
    database_url: str = "sqlite:///./clawgate.db"
    data_dir: Path = DEFAULT_DATA_DIR
    capture_batch_size: int = Field(default=256, ge=1)
    capture_flush_interval: float = Field(default=0.02, gt=0)
    capture_max_queue: int = Field(default=100_000, ge=1)
    # A call is committed before its response ends (the last chunk waits for it): nothing served is lost even to a
    # SIGKILL. Off: calls are committed within capture_flush_interval after they end (a kill -9 may lose those).
    capture_durable: bool = True
    # Postgres' synchronous_commit for the capture transaction (SQLite ignores it). off: a commit returns once it is
    # in Postgres' WAL buffers, not on disk, so a served call survives the gateway being killed (its commit is
    # Postgres' already) and only a crash of the Postgres host itself can lose the last ~3 x wal_writer_delay
    # (0.6 s) of calls; a durable call then waits for no WAL flush of its own. on: every commit waits for its fsync.
    capture_synchronous_commit: Literal["on", "off"] = "off"

    # Responses API: how many stored responses are cached in memory for `previous_response_id` (all are stored in
    # the database, for every gateway process).
    responses_store_size: int = Field(default=2048, ge=0)
    # Seconds a graceful stop (SIGTERM) waits for calls in flight to finish before cutting them (recorded cancelled).
    shutdown_timeout: int = Field(default=60, gt=0)
    # The largest request body accepted (bytes); larger ones get a 413 before they are read whole (0: no limit).
    max_request_bytes: int = Field(default=32 * 1024 * 1024, ge=0)

    # Retention: rollouts with no activity for this many days are deleted with everything derived from them
    # (``gateway/store/retention.py``), every retention_interval seconds by each gateway; None keeps everything.
    retention_days: float | None = Field(default=None, gt=0)
    retention_interval: float = Field(default=3600.0, gt=0)

    # Credentials in captured traffic (``gateway/credentials``): "exclude" (default) finds them on capture, never
    # trains on an answer that holds one and redacts them where text is shown; "mask" trains such an answer but leaves
    # the credential's own tokens out of the loss; "drop" also replaces the credential's tokens (with a filler token)
    # and text in what is stored, which leaves every call whose context held one untrainable; "off" neither scans
    # nor excludes (text is still redacted where shown). Read by the gateways (scanning) and the trainer.
    secrets: Literal["exclude", "mask", "drop", "off"] = "exclude"

    # Implicit sessions (and harness sessions) count as finished after this many idle seconds.
    session_idle_timeout: float = Field(default=1800.0, gt=0)
    # The session index keeps a turn nobody continued for this many seconds (at most the idle timeout); a later
    # continuation is found in the database, exactly. Agent turns come seconds apart, so a few minutes keep nearly
    # every continuation in memory, while memory follows the last few minutes' conversations instead of the last
    # half hour's (measured: about 1 KB per call held).
    session_cache_idle: float = Field(default=300.0, gt=0)
    # The most token ids the session index holds in memory (raw prompt + completion of recent calls, for splicing;
    # about 8 bytes each, plus 32 per distinct token); least recently used calls are forgotten beyond it.
    session_index_tokens: int = Field(default=20_000_000, ge=1)

    # Where `clawgate rollout` reaches the gateway (default http://127.0.0.1:8080).
    gateway_url: str | None = None

    # Auth
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    admin_key: SecretStr | None = None
    # The server secret tenant keys are hashed under (HMAC-SHA256); every gateway and `clawgate keys` must share it.
    # Changing it invalidates every tenant key. Unset: keys are hashed under a public label (``gateway/tenants``).
    key_secret: SecretStr | None = None
    # How long a gateway process trusts its verdict on a tenant key before reading it again (a revocation's delay).
    key_cache_ttl: float = Field(default=0.5, gt=0, le=60)
    # How often a gateway process writes its quota counts and reads every process's (the quotas' error margin).
    quota_sync_interval: float = Field(default=0.25, gt=0, le=60)

    log_level: str = "info"

    @field_validator("api_keys", "model_aliases", "reward_functions", "vllm_replicas", mode="before")
    @classmethod
    def _csv(cls, value: object) -> object:
        return _split_csv(value)

    @field_validator("judge_model", "judge_api_base", "judge_api_key_env", "judge_rubric", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # docker compose passes `${VAR:-}` as an empty string: that means "not configured", not a model named "".
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("train_log_to", mode="before")
    @classmethod
    def _known_loggers(cls, value: object) -> object:
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        names = [n.strip() for n in str(value).split(",") if n.strip()]
        unknown = [n for n in names if n not in ("tensorboard", "wandb")]
        if unknown:
            raise ValueError(f"unknown logger {', '.join(unknown)}: choose tensorboard and/or wandb")
        return ",".join(names)

    @model_validator(mode="after")
    def _production_secrets(self) -> Settings:
        if self.environment == "production":
            if not self.api_keys:
                raise ValueError("CLAWGATE_API_KEYS must be set in production")
            if self.admin_key is None or self.admin_key.get_secret_value().lower() in PLACEHOLDER_SECRETS:
                raise ValueError("CLAWGATE_ADMIN_KEY must be set to a real secret in production")
            weak = [k for k in self.api_keys if k.lower() in PLACEHOLDER_SECRETS]
            if weak:
                raise ValueError("CLAWGATE_API_KEYS contains a placeholder key")
        return self

    @property
    def promotion_mode(self) -> Literal["guarded", "immediate"]:
        if self.promotion is not None:
            return self.promotion
        return "guarded" if self.environment == "production" else "immediate"

    @property
    def key_secret_bytes(self) -> bytes | None:
        return self.key_secret.get_secret_value().encode() if self.key_secret is not None else None

    @property
    def reward_worker_enabled(self) -> bool:
        """Whether turns get rewards from the reward worker (a judge model or reward functions)."""
        return self.judge_model is not None or bool(self.reward_functions)

    @property
    def awaits_judge(self) -> bool:
        """Whether the trainer waits for the reward worker's verdict on a turn before training it."""
        return self.reward_worker_enabled if self.train_await_judge is None else self.train_await_judge

    @property
    def model_name(self) -> str:
        """The name clients use for the base policy."""
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model).expanduser()
        looks_local = path.exists() or self.model.startswith((".", "/", "~"))
        return path.name if looks_local else self.model


def environment_of(settings: Settings, names: Iterable[str]) -> dict[str, str]:
    """The ``CLAWGATE_*`` variables that give a child process these settings among ``names`` (set ones only)."""
    out: dict[str, str] = {}
    for name in names:
        value = getattr(settings, name)
        if value is not None:
            out[f"CLAWGATE_{name.upper()}"] = str(value)
    return out


def from_flags(args: object, names: Iterable[str]) -> Settings:
    """Settings from the environment with the command-line flags among ``names`` over it: a flag given wins, one
    left out (None) leaves the environment's value."""
    overrides: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return Settings(**overrides)
