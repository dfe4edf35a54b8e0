"""The dataset format and what describes it: the writer and reader (format.py), its checks (validate.py), its
description (inspect.py), where a dataset lives (locations.py), its Hub card (card.py), and the transforms that
write a new dataset from others without scoring (filter.py, merge.py; their options in config.py).
Nothing here loads a model: scoring lives in offline_rec/rewards/, importing in offline_rec/importers/."""
