"""The prefix tree of a rollout: its captured calls merged on shared token prefixes, filtered for credit.

Pure: numpy only, no database, no torch, nothing of the gateway or the trainer. The store builds trees from what
it recorded (``gateway/store/training_data.py``), the gateway shows them (``GET /v1/rollouts/{id}/tree``), the
trainer packs and trains them.

- ``nodes``: ``CallView`` (one call as the tree needs it), ``TreeNode``, ``TreePath``, ``TreeCall``, ``TreeReport``;
- ``filters``: the branch filtering rules and their switches (``TreeConfig``);
- ``build``: ``build_tree``, the reconstruction;
- ``tree``: ``RolloutTree``, the result, with its paths and JSON and text views.
"""

from prefix_tree.build import build_tree
from prefix_tree.filters import TreeConfig
from prefix_tree.nodes import CallView, TreeCall, TreeNode, TreePath, TreeReport
from prefix_tree.tree import RolloutTree

__all__ = ["CallView", "RolloutTree", "TreeCall", "TreeConfig", "TreeNode", "TreePath", "TreeReport", "build_tree"]
