import torch

a=torch.randn(64,128,device='cuda',dtype=torch.bfloat16); b=torch.randn(128,32,device='cuda',dtype=torch.bfloat16)
acc=torch.randn(64,32,device='cuda',dtype=torch.float32); ref=acc+(a.float()@b.float())
r=torch.addmm(acc,a,b,out_dtype=torch.float32,out=acc)
print("addmm dtype_out inplace ok", r.data_ptr()==acc.data_ptr(), (acc-ref).abs().max().item())
v=acc[:, :16]
try:
    torch.addmm(v, a, b[:, :16], out_dtype=torch.float32, out=v); print("noncontig out ok")
except Exception as e: print("noncontig out fails", e)
