"""Who a request is, once its key is checked: what it may read and write follows from this alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DEFAULT_TENANT = "default"
Role = Literal["admin", "user", "rollout"]


@dataclass(frozen=True, slots=True)
class Principal:
    """``tenant`` None: the global admin (``CLAWGATE_ADMIN_KEY``), who sees every tenant."""

    tenant: str | None
    role: Role
    key_id: str | None = None  # a database key's public id (never the key)
    rollout_id: str | None = None  # a rollout key's own rollout

    @property
    def is_global(self) -> bool:
        return self.tenant is None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def serving_tenant(self) -> str:
        """The tenant a call served for this principal belongs to (the global admin's calls: the default one)."""
        return self.tenant if self.tenant is not None else DEFAULT_TENANT

    def listed(self, asked: str | None) -> tuple[bool, str | None]:
        """A listing filtered by tenant ``asked`` (None: any): whether it may show anything, and the tenant to
        filter by (None: all). A tenant's key lists its own tenant's records only; asking for another's lists none."""
        if self.tenant is None:
            return True, asked
        return asked in (None, self.tenant), self.tenant

    def sees(self, tenant: str | None) -> bool:
        """Whether data of ``tenant`` is visible: the global admin sees all, everyone else their own tenant."""
        return self.tenant is None or tenant == self.tenant


GLOBAL_ADMIN = Principal(tenant=None, role="admin")
DEFAULT_USER = Principal(tenant=DEFAULT_TENANT, role="user")
