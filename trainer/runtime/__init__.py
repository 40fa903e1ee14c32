"""trainer/runtime"""
