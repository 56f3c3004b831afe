"""Guarded promotion: a published policy version earns its traffic.

A version the trainer publishes is a *candidate*. With ``CLAWGATE_PROMOTION=guarded`` it serves a *canary*: a fixed
share of new conversations, chosen from the conversation's id so that every gateway agrees (``routing.py``), beside
the *incumbent* (the newest promoted version), which serves everything else. From the rewards each arm's turns earn
(judge scores, feedback, rules, verifiers) and each arm's call error rate, a sequential test (``stats.py``) promotes
the candidate when it is not worse than the incumbent by more than a margin, or rejects it as soon as it is worse
with confidence; a canary that reaches its time limit undecided gets the configured default outcome. The stages and
every decision live in the database (``store/promotion.py``); each gateway's ``Promoter`` (``promoter.py``) takes
decisions with a compare-and-set, so one gateway's decision is everyone's. With ``immediate`` every published version
serves all traffic at once, as before.
"""
