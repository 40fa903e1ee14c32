"""trainer/models"""
