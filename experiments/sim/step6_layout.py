"""Layout simulation of experiments/step6-vector.patch: every bf16 element of the q and k tiles is
written once by the 16-byte path and the old 4-byte path, with the same scale, beta and swizzle.
Run: python experiments/sim/step6_layout.py (no GPU; pure index arithmetic)."""
# Patch 1: old vs new step-6 mapping. For each tile (q/k), byte offset -> (row, feature, ref block, ref feature, beta row, which half of the word)
kBoxBytes=8192; kSubBlock=16
def old():
    m={}
    for tid in range(128):
        h, cp = tid>>6, tid&63
        c=(2*cp)&63; base=(cp>>5)*kBoxBytes+((c&7)<<1); chunk=c>>3
        for bb in range(2):
            b=2*h+bb; row0=kSubBlock*b
            for ii in range(16):
                row=row0+ii
                off=base+row*128+(((chunk^row)&7)<<4)
                for e in range(2):  # lo -> s0 (feature 2cp), hi -> s1 (2cp+1)
                    o=off+2*e
                    assert o not in m
                    m[o]=dict(row=row,feat=2*cp+e,refb=b,reff=2*cp+e,beta=row0+ii)
    return m
def new():
    m={}; vec=[]
    for tid in range(128):
        warp, lane = tid>>5, tid&31
        cc=lane&15; c8=cc&7; r0=kSubBlock*warp+8*(lane>>4)
        ref_byte=(warp*128+8*cc)*4   # a_ref/r_block float offset*4 within [4][128]
        assert ref_byte%16==0
        assert (r0*4)%16==0 and ((r0+4)*4)%16==0
        for i in range(8):
            row=r0+i
            off=(cc>>3)*kBoxBytes+row*128+(((c8^row)&7)<<4)
            assert off%16==0
            vec.append(off)
            for x in range(4):
                for e in range(2):
                    o=off+4*x+2*e
                    assert o not in m
                    # element pair x: q2.x*sc[2x], q2.y*sc[2x+1]; sc[j]=exp2(ref[warp][8cc+j])
                    m[o]=dict(row=row,feat=None,refb=warp,reff=8*cc+2*x+e,beta=r0+i)
    return m,vec
mo=old(); mn,vec=new()
assert set(mo)==set(mn)==set(range(0,16384,2)), (len(mo),len(mn))
assert len(vec)==len(set(vec))==1024
bad=0
for o in mo:
    a=mo[o]; b=mn[o]
    # feature stored at offset o (from the old path, which is the reference layout)
    if (a['row'],a['refb'],a['reff'],a['beta'])!=(b['row'],b['refb'],b['reff'],b['beta']): bad+=1
    # ref block == row block, ref feature == stored feature
    assert a['refb']==a['row']//16 and a['reff']==a['feat']
print("step6: 16384 bytes covered once by both; 1024 16B chunks once; mismatches:",bad)
