"""Trainers other than ours: ``trl sft``, axolotl, LLaMA-Factory and HfArgumentParser scripts.

The job's ``trainer:`` section names the tool and the user's own config. The supervisor never
imports the tool: it reads the config (YAML, or the script's flags), maps the ladder's knobs to
the tool's keys (:mod:`.tables`), writes each attempt's config into the attempt's directory
(:mod:`.attempt_config`; the user's file is never touched), and starts the tool with the shim on
its ``PYTHONPATH`` (:mod:`.launch`, ``trainer_child/shim/``).
"""
