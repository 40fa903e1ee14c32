"""trainer/rollout"""
