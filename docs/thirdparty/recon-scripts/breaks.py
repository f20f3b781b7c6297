import re,sys
# concise list of graph breaks of rank0 from a TORCH_LOGS=graph_breaks log
lines=[l for l in open(sys.argv[1]) if l.startswith('[rank0]') and '__graph_breaks' in l]
txt=[re.sub(r'^.*\[__graph_breaks\] ?','',l.rstrip('\n')) for l in lines]
i=0
while i<len(txt):
    t=txt[i]
    if t.startswith('Graph break'):
        frame=re.search(r'\] \[(\d+/\d+)\]', lines[i]).group(1)
        block=[t]
        j=i+1
        while j<len(txt) and not txt[j].startswith('Graph break'):
            block.append(txt[j]); j+=1
        reason=[b for b in block if b.startswith('Graph Break Reason') or b.strip().startswith('Explanation') or 'Developer debug context' in b]
        # last user frames
        ut=[k for k,b in enumerate(block) if b.strip().startswith('File "')]
        user=[block[k].strip()+' | '+block[k+1].strip() for k in ut[-3:] if k+1<len(block)]
        print(f'--- frame {frame}: {t}')
        for r in reason[:4]: print('    ',r.strip()[:400])
        for u in user: print('     @',u[:300])
        i=j
    else: i+=1
