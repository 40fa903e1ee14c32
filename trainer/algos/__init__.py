"""trainer/algos"""
