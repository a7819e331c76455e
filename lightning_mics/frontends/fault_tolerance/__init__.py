"""The front ends' side of fault-tolerant replica groups on torchft ([Note: fault-tolerant replica groups] in
options.py): ``groups.py`` (the quorum, the cross-group average, a step not taken, each group's data) and
``trainer_quorum.py`` (the Trainer's quorum callback)."""
