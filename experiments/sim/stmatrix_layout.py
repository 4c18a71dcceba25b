"""Layout simulation of the exact pass's stmatrix.x4.trans staging (merged in 132090b: intra_chunk_math.cuh, wide_diagonal_terms), the exact
pass's ldmatrix addressing and m16n8k16 fragments, checked against direct sums over the 64
features for every pair j < i of all four levels (random integers, so the sums are exact).
Run: python experiments/sim/stmatrix_layout.py (no GPU; pure index arithmetic)."""
import random
random.seed(1)
def wso(row,chunk): return row*128+((chunk^(row&7))<<4)
# --- warp primitives on a byte-addressed bf16 memory (dict: byte offset -> value) ---
def st_u32(mem,addr,pair): mem[addr]=pair[0]; mem[addr+2]=pair[1]
def stmatrix_x4_trans(mem,addrs,regs):  # regs[lane][m] = (lo,hi)
    for a in addrs: assert a%16==0
    for m in range(4):
        for l in range(32):
            r=l//4
            for h in range(2):
                c=2*(l%4)+h
                a=addrs[8*m+c]+2*r
                mem[a]=regs[l][m][h]
def ldmatrix_x4(mem,addrs):
    out=[[None]*4 for _ in range(32)]
    for m in range(4):
        for l in range(32):
            a=addrs[8*m+l//4]+4*(l%4)
            out[l][m]=(mem[a],mem[a+2])
    return out
def mma(af,b0,b1,acc):  # m16n8k16 row.col; af[lane][4], b0/b1[lane]
    A=[[None]*16 for _ in range(16)]; B=[[None]*8 for _ in range(16)]
    for l in range(32):
        g,t=l//4,l%4
        for h in range(2):
            A[g][2*t+h]=af[l][0][h]; A[g+8][2*t+h]=af[l][1][h]
            A[g][2*t+8+h]=af[l][2][h]; A[g+8][2*t+8+h]=af[l][3][h]
            B[2*t+h][g]=b0[l][h]; B[2*t+8+h][g]=b1[l][h]
    for l in range(32):
        g,t=l//4,l%4
        for x in range(4):
            i=g+8*(x>>1); j=2*t+(x&1)
            acc[l][x]+=sum(A[i][k]*B[k][j] for k in range(16))
def run(variant):
    # per lane p: pair of features 2p,2p+1; values per (level, operand, row ii) : random ints
    V={}
    for level in range(4):
        for opn in ('ku','qu','kl'):
            for ii in range(16):
                V[level,opn,ii]=[(random.randint(-50,50),random.randint(-50,50)) for p in range(32)]
    results={}
    for level in range(4):
        lh=3-level; half=1<<lh
        mem={}
        up_k=[None]*8; up_q=[None]*8; low_k=[None]*8
        def stage4(row0,vals):
            for v in vals: assert v is not None
            addrs=[wso(row0+(l>>3),l&7) for l in range(32)]
            regs=[[vals[m][l] for m in range(4)] for l in range(32)]
            stmatrix_x4_trans(mem,addrs,regs)
        for ii in range(1,16):
            if ii & half:
                u=((ii>>(lh+1))<<lh)+(ii&(half-1))
                if variant=='old':
                    for l in range(32):
                        st_u32(mem,wso(u,l>>2)+((l&3)<<2),V[level,'ku',ii][l])
                        st_u32(mem,wso(8+u,l>>2)+((l&3)<<2),V[level,'qu',ii][l])
                else:
                    up_k[u]=V[level,'ku',ii]; up_q[u]=V[level,'qu',ii]
                    if (u&3)==3:
                        stage4(u-3,up_k[u-3:u+1]); stage4(8+u-3,up_q[u-3:u+1])
        for ii in range(15,-1,-1):
            if not (ii & half):
                u=((ii>>(lh+1))<<lh)+(ii&(half-1))
                if variant=='old':
                    for l in range(32): st_u32(mem,wso(16+u,l>>2)+((l&3)<<2),V[level,'kl',ii][l])
                else:
                    low_k[u]=V[level,'kl',ii]
                    if (u&3)==0: stage4(16+u,low_k[u:u+4])
        assert set(mem)==set(range(0,24*128,2)), "staging incomplete"
        acc_lo=[[0]*4 for _ in range(32)]; acc_hi=[[0]*4 for _ in range(32)]
        for ks in (0,2):
            bf=ldmatrix_x4(mem,[wso(16+(l&7),2*ks+(l>>3)) for l in range(32)])
            af=ldmatrix_x4(mem,[wso(((l>>3)&1)*8+(l&7),2*ks+((l>>3)>>1)) for l in range(32)])
            mma(af,[b[0] for b in bf],[b[1] for b in bf],acc_lo)
            af=ldmatrix_x4(mem,[wso(((l>>3)&1)*8+(l&7),2*ks+2+((l>>3)>>1)) for l in range(32)])
            mma(af,[b[2] for b in bf],[b[3] for b in bf],acc_hi)
        # write_level: lane (g4,t4): upper u=g4, lower c=2t4+e
        for l in range(32):
            g4,t4=l>>2,l&3
            i=((g4>>lh)<<(lh+1))+half+(g4&(half-1))
            for e in range(2):
                c=2*t4+e
                if (g4>>lh)==(c>>lh):
                    j=((c>>lh)<<(lh+1))+(c&(half-1))
                    kk=acc_lo[l][e]+acc_hi[l][e]; qk=acc_lo[l][2+e]+acc_hi[l][2+e]
                    # direct sums over the 64 features
                    dk=sum(V[level,'ku',i][p][h]*V[level,'kl',j][p][h] for p in range(32) for h in range(2))
                    dq=sum(V[level,'qu',i][p][h]*V[level,'kl',j][p][h] for p in range(32) for h in range(2))
                    assert kk==dk and qk==dq, (variant,level,i,j)
                    assert (i,j) not in results; results[i,j]=(kk,qk)
    # every pair j<i exactly once
    assert set(results)=={(i,j) for i in range(16) for j in range(i)}
    return results
for trial in range(20):
    s=random.random()
    random.seed(s); ro=run('old'); random.seed(s); rn=run('new')
    assert ro==rn
print("stmatrix: 20 random trials, old and new staging both equal the direct feature sums for all 120 pairs (4 levels)")
# feature permutation check
mem={}
addrs=[wso(0+(l>>3),l&7) for l in range(32)]
stmatrix_x4_trans(mem,addrs,[[((2*l+0,m),(2*l+1,m)) for m in range(4)] for l in range(32)])
for j in range(8):
    for e in range(8):
        f,m=mem[wso(0,j)+2*e]; assert m==0 and f==8*e+j
print("row 0 chunk j element e holds feature 8e+j: confirmed")
